"""Watch a training job's data loading: measurements, the diagnosis, the in-loop wrapper, the second-terminal view."""
