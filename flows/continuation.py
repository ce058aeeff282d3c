"""Crashed deployment runs continue by themselves, a bounded number of times, with the same run key.

Prefect 3 does not retry a Crashed flow run (flow retries cover Failed only), and an ``on_crashed`` hook does not
run when the flow-run process is SIGKILLed or OOM-killed: nothing in that process runs any more. What does happen
is that the process worker (or ``serve``) sees the process exit and sets the run Crashed, and the server emits a
``prefect.flow-run.Crashed`` event. Each deployment in ``deployments/prefect.yaml`` has a trigger on that event,
for runs of that deployment, which runs the deployment again with ``continue_flow_run`` naming the crashed run.

The continuation takes everything from the chain of runs it continues, all of it stored by Prefect (durable,
nothing in memory): the settings from the chain's first run (the parameters Prefect stored for it: its
deployment's, with the ones that run set laid over them; a continuation's own settings are only the
deployment's), and the run key from the tag every run puts on itself at start. It then runs as
``resume=<run key>``: the last checkpoint, the same MLflow run, at most one registered version. The run lease
keeps it from training beside a driver that still lives. The chain's length is the crash count: beyond
``max_crash_resumes`` the continuation refuses, and says so in its Failed state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import get_run_logger

from raytrain_tasks.config import TrainingConfig, config_from_parameters
from raytrain_tasks.errors import ContinuationError, SettingsError

RUN_KEY_TAG_PREFIX = "run-key:"
FLOW_RUN_RESOURCE_PREFIX = "prefect.flow-run."
CHAIN_LIMIT = 50  # far beyond any max_crash_resumes: a loop in the chain cannot keep us walking


@dataclass(frozen=True)
class Continuation:
    config: TrainingConfig  # the chain's settings, with resume set to its run key when it had one
    run_key: str | None  # None: the crash came before a run key was recorded; the continuation starts afresh
    crashes: int  # crashed runs in the chain, this one included


def prepare_recovery(run_key: str) -> None:
    """At the start of a run: tag it with its run key, so that a continuation (or a person) finds it in Prefect;
    for a run watched for missing heartbeats, check that it sends them that often and that the watch exists."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.settings import get_current_settings

    flow_run_id = flow_run.get_id()
    if not flow_run_id:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(str(flow_run_id)))
        tags = list(run.tags or [])
        client.update_flow_run(UUID(str(flow_run_id)), tags=[*tags, f"{RUN_KEY_TAG_PREFIX}{run_key}"])
    if HEARTBEAT_TAG not in tags:
        return
    every = get_current_settings().flows.heartbeat_frequency
    silence = silence_seconds()
    if every is None or every > HEARTBEAT_SECONDS:
        # Fail closed: the zombie automation would set this live run Crashed after `silence` seconds of quiet.
        raise ContinuationError(
            f"this run is tagged {HEARTBEAT_TAG!r} (watched for {silence} s without a heartbeat) but sends "
            f"heartbeats every {every} s; set PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_SECONDS} in the "
            "deployment's job variables (deployments/prefect.yaml does), or remove the tag"
        )
    flow_name = str(flow_run.get_flow_name())
    ensure_zombie_automation(flow_name)
    _heartbeat_now(run, flow_name, tags)


def _heartbeat_now(run: Any, flow_name: str, tags: list[str]) -> None:
    """One heartbeat event now, as Prefect's engine sends them (prefect.flow_engine._emit_flow_run_heartbeat).
    The engine's first beat may have come before the watch existed, and its next one comes 30 s later: a run lost
    in between was never found."""
    from prefect import __version__
    from prefect.events.related import RelatedResource, tags_as_related_resources
    from prefect.events.utilities import emit_event

    related = [
        RelatedResource.model_validate(
            {
                "prefect.resource.id": f"prefect.flow.{run.flow_id}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": flow_name,
            }
        )
    ]
    if run.deployment_id:
        related.append(
            RelatedResource.model_validate(
                {
                    "prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                    "prefect.resource.role": "deployment",
                }
            )
        )
    resource = {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name or ""}
    emit_event(
        event="prefect.flow-run.heartbeat",
        resource=resource | {"prefect.version": __version__},
        related=related + tags_as_related_resources(set(tags)),
    )


def continuation_of(crashed: str) -> Continuation:
    """What continuing the crashed flow run ``crashed`` (an id, or the ``prefect.flow-run.<id>`` resource id of
    its Crashed event) means; ContinuationError when it must not be continued."""
    from prefect.client.orchestration import get_client

    first_id = _flow_run_id(crashed)
    with get_client(sync_client=True) as client:
        chain = _chain(client, first_id)
        latest, root = chain[0], chain[-1]
        if latest.state_type is None or latest.state_type.value != "CRASHED":
            raise ContinuationError(
                f"flow run {latest.id} ({latest.name}) is {latest.state_name}, not Crashed: there is nothing to "
                "continue"
            )
        try:
            config = config_from_parameters(root.parameters or {})  # already laid over its deployment's
        except SettingsError as exc:
            raise ContinuationError(
                f"flow run {root.id} ({root.name}) has no valid settings to continue with: {exc}"
            ) from exc
    keys = {
        tag.removeprefix(RUN_KEY_TAG_PREFIX) for run in chain for tag in run.tags if tag.startswith(RUN_KEY_TAG_PREFIX)
    }
    if len(keys) > 1:
        raise ContinuationError(f"the crashed runs {[str(run.id) for run in chain]} carry several run keys {keys}")
    run_key = keys.pop() if keys else None
    crashes = sum(1 for run in chain if run.state_type is not None and run.state_type.value == "CRASHED")
    if crashes > config.max_crash_resumes:
        raise ContinuationError(
            f"run {run_key or '(no run key yet)'} crashed {crashes} times (flow runs "
            f"{', '.join(run.name for run in reversed(chain))}); max_crash_resumes={config.max_crash_resumes}, so it "
            "is not continued again. Find the cause in those runs' logs (an OOM kill, a lost node), then "
            + (f"continue it by hand with resume={run_key}" if run_key else "start it again")
        )
    if run_key is not None:
        config = config.model_copy(update={"resume": run_key})
    return Continuation(config=config, run_key=run_key, crashes=crashes)


# Prefect's run-deployment action creates one run per invocation of the automation (its idempotency key names the
# invocation, not the event), and one Crashed event was seen to invoke the crash trigger twice (0.4 s apart, after
# `prefect deploy` replaced the trigger). The run lease keeps a second continuation from training beside the first,
# but it would end Failed on that lease, a false alarm at night. So a continuation first looks for an earlier one.
GIVEN_UP = frozenset({"FAILED", "CANCELLED", "CRASHED"})  # an earlier continuation in these left the crash to us


def earlier_continuation(crashed: str, this_run: UUID) -> Any | None:
    """The first flow run, created before ``this_run``, that continues the same crashed run and has not ended
    Failed, Cancelled or Crashed; None when ``this_run`` is the one to continue it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    crashed_id = _flow_run_id(crashed)
    with get_client(sync_client=True) as client:
        crashed_run = client.read_flow_run(crashed_id)
        this = client.read_flow_run(this_run)
        since = crashed_run.state.timestamp if crashed_run.state is not None else crashed_run.created
        # The continuations of a crash are runs of its flow, created (and expected to start) after it crashed.
        candidates = client.read_flow_runs(
            flow_filter=FlowFilter(id=FlowFilterId(any_=[crashed_run.flow_id])),
            flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,  # the earliest first, should more than the limit follow
            limit=200,
        )
    earlier = [
        run
        for run in candidates
        if run.id != this.id
        and _continues(run, crashed_id)
        and (run.created, str(run.id)) < (this.created, str(this.id))
        and (run.state_type is None or run.state_type.value not in GIVEN_UP)
    ]
    return min(earlier, key=lambda run: (run.created, str(run.id)), default=None)


def already_continued(crashed: str) -> str | None:
    """Why this flow run must leave the crashed run ``crashed`` to another continuation; None when it is the one."""
    from prefect.runtime import flow_run

    this_run = flow_run.get_id()
    if not this_run:
        return None
    first = earlier_continuation(crashed, UUID(str(this_run)))
    if first is None:
        return None
    return (
        f"flow run {first.name} ({first.id}) already continues crashed flow run "
        f"{crashed.removeprefix(FLOW_RUN_RESOURCE_PREFIX)}: this one ends without training (the crash trigger "
        "fired more than once)"
    )


def _continues(run: Any, crashed_id: UUID) -> bool:
    named = (run.parameters or {}).get("continue_flow_run")
    try:
        return bool(named) and _flow_run_id(str(named)) == crashed_id
    except ContinuationError:
        return False


def _flow_run_id(crashed: str) -> UUID:
    try:
        return UUID(crashed.removeprefix(FLOW_RUN_RESOURCE_PREFIX))
    except ValueError as exc:
        raise ContinuationError(f"continue_flow_run={crashed!r} is not a flow run id") from exc


def _chain(client: Any, first_id: UUID) -> list[Any]:
    """The crashed run, the run it continued, and so on back to the first: newest first."""
    chain = [client.read_flow_run(first_id)]
    while (previous := chain[-1].parameters.get("continue_flow_run")) and len(chain) < CHAIN_LIMIT:
        try:
            previous_id = UUID(str(previous).removeprefix(FLOW_RUN_RESOURCE_PREFIX))
        except ValueError as exc:
            raise ContinuationError(f"flow run {chain[-1].id} continues {previous!r}, not a flow run id") from exc
        if previous_id in {run.id for run in chain}:
            break
        chain.append(client.read_flow_run(previous_id))
    return chain


def log_continuation(continuation: Continuation, crashed: str) -> None:
    get_run_logger().warning(
        "continuing crashed flow run %s (crash %d of at most %d): %s",
        crashed.removeprefix(FLOW_RUN_RESOURCE_PREFIX),
        continuation.crashes,
        continuation.config.max_crash_resumes,
        f"resuming run {continuation.run_key} from its last checkpoint"
        if continuation.run_key
        else "it crashed before it had a run key, so this run starts it afresh",
    )


# --- zombie runs: a run whose process vanished without anyone setting it Crashed --------------------------------

HEARTBEAT_TAG = "heartbeats-30s"  # on runs whose process sends a heartbeat event every 30 s (the deployments')
HEARTBEAT_SECONDS = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY of those runs; Prefect's minimum
SILENCE_SECONDS = 4 * HEARTBEAT_SECONDS  # four missed beats: the process is gone, not slow
SILENCE_ENV = "PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS"  # another window, for the server's whole watch
MIN_SILENCE_SECONDS = 2 * HEARTBEAT_SECONDS  # one late beat never looks like a lost process
REARM_PAGE = 200  # watched runs read per request when a watch is re-armed (the server's default limit)
WATCH_LOAD_SECONDS = 8  # the server's triggers service loads a new or changed watch within this (reconcile: 5 s)
ZOMBIE_AUTOMATION = "prefect-raytrain: a training run that stopped sending heartbeats is Crashed"


def silence_seconds() -> int:
    """The zombie watch's window: ``SILENCE_SECONDS`` unless ``PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS`` sets
    another, of at least two heartbeats (ContinuationError otherwise: a shorter window would crash live runs)."""
    import os

    value = os.environ.get(SILENCE_ENV, "").strip()
    if not value:
        return SILENCE_SECONDS
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds < MIN_SILENCE_SECONDS:
        raise ContinuationError(
            f"{SILENCE_ENV}={value!r} is not a whole number of seconds of at least {MIN_SILENCE_SECONDS} (two "
            f"heartbeats of {HEARTBEAT_SECONDS} s): a shorter window would set live runs Crashed. Unset it for "
            f"the default of {SILENCE_SECONDS} s"
        )
    return seconds


def zombie_automation(flow_name: str, silence: int = SILENCE_SECONDS) -> Any:
    """Prefect's documented zombie-run automation, narrowed to runs of ``flow_name`` tagged ``HEARTBEAT_TAG``.

    When the worker dies with the flow-run process (a lost machine), nobody sets the run Crashed and it would stay
    Running forever. Every tagged run sends heartbeats; one that is silent for ``silence`` seconds without reaching
    a final state is set Crashed, and the deployment's crash trigger then continues it. Only runs tagged as sending
    heartbeats that often are watched: a run with Prefect's default of one per 180 s would be crashed while alive.
    """
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=(
            f"Runs of {flow_name} tagged {HEARTBEAT_TAG} send a heartbeat every {HEARTBEAT_SECONDS} s. One silent "
            f"for {silence} s without finishing lost its process (and its worker): it is set Crashed, so "
            "that its deployment's crash trigger continues it from its last checkpoint."
        ),
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=[
                {"prefect.resource.role": "flow", "prefect.resource.name": flow_name},
                {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{HEARTBEAT_TAG}"},
            ],
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                name="Crashed",
                message=(
                    f"no heartbeat for {silence} s: the process running this flow and its worker are gone "
                    "(a lost machine or a killed container)"
                ),
            )
        ],
    )


def ensure_zombie_automation(flow_name: str) -> bool:
    """Create the zombie automation on the current Prefect server unless it is there; one copy, however many
    processes ensure it at the same time (each keeps the one with the lowest id and deletes the rest). A copy
    with another window than this process's ``silence_seconds()`` is brought to it: the window is the server's
    whole watch, set where its runs and ``serve`` start (``PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS``). True when
    this call created the watch or changed its window."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    wanted = zombie_automation(flow_name, silence_seconds())
    with get_client(sync_client=True) as client:
        changed = False
        if not client.read_automations_by_name(ZOMBIE_AUTOMATION):
            client.create_automation(wanted)
            changed = True
        found = sorted(client.read_automations_by_name(ZOMBIE_AUTOMATION), key=lambda automation: str(automation.id))
        if found and getattr(found[0].trigger, "within", None) != wanted.trigger.within:
            # Prefect gives the trigger a new id on every update and keys each watched run's open window (its
            # "bucket") by trigger id: the update forgets every run watched so far (re-armed below).
            client.update_automation(found[0].id, wanted)
            changed = True
        for duplicate in found[1:]:
            try:
                client.delete_automation(duplicate.id)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code != 404:  # 404: another process deleted it first
                    raise
    if changed:
        _rearm_watched_runs(flow_name)
    return changed


def _rearm_watched_runs(flow_name: str) -> None:
    """A new or changed watch knows no run yet: a run whose process is lost before its engine's next beat (30 s)
    would stay Running for ever. Once the server's triggers service has loaded the watch (at once, or at its next
    reconcile, every 5 s), one beat for each watched run still Running (or Cancelling) opens its window afresh. A
    run already gone is found one window later than it would have been; none is lost. (Sent from inside a run,
    Prefect relates each beat to that run too; the watch keys on the beat's own run.)"""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType

    time.sleep(WATCH_LOAD_SECONDS)
    beating = FlowRunFilter(  # a Cancelling run still beats, and is watched, until it ends
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.CANCELLING])),
        tags=FlowRunFilterTags(all_=[HEARTBEAT_TAG]),
    )
    of_the_flow = FlowFilter(name=FlowFilterName(any_=[flow_name]))
    with get_client(sync_client=True) as client:
        offset = 0
        while page := client.read_flow_runs(
            flow_filter=of_the_flow, flow_run_filter=beating, offset=offset, limit=REARM_PAGE
        ):
            for run in page:
                _heartbeat_now(run, flow_name, list(run.tags or []))
            offset += len(page)
