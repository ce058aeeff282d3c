"""The seeds' `train_ray_ddp_with_ray_data.py` as Ray Train's own train_func (Ray Data shards), through the flow."""
