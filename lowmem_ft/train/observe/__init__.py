"""What a run shows: the memory monitor, the progress bar, the banner, the trackers, the run's totals."""
