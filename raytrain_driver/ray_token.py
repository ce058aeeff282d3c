"""Whether a Ray cluster takes this driver's authentication token, asked before ray.init() joins it."""

from __future__ import annotations

from raytrain_tasks.errors import ClusterError

TOKEN_REFUSED = (
    "the Ray cluster at {address!r} refused this driver's authentication token. Ray clusters use token "
    "authentication by default: set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, or "
    "RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token) in this process's environment, or check `ray_address`"
)


def check_token_accepted(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds where the cluster refuses this driver's token: ray.init() retries for half a minute, with
    warnings on the console, before it gives up. One call to the GCS, with the token ray.init() would send.
    Anything but a refusal (an old Ray without these modules, another error) is left to ray.init(), which says
    more about it."""
    if address == "auto" or address.startswith("ray://"):
        return
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # pragma: no cover - Ray moved them: ray.init() still refuses, only slower
        return
    channel = init_grpc_channel(address)
    try:
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # generated, no stubs
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ClusterError(TOKEN_REFUSED.format(address=address)) from None
    finally:
        channel.close()
