"""Stage processes: supervision, the detached runner, the OS seam, states and logs."""
