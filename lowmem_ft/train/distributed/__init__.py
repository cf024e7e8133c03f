"""Several processes: the accelerate launch and its checks, the ranks agreeing."""
