"""The seeds' `train_ray_ddp.py`, as Ray Train's own train_func (a torch DataLoader), through the pipeline."""
