"""A model sharded with FSDP2 (fully_shard), checkpointed by every rank with torch.distributed.checkpoint."""
