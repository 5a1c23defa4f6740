"""Pipeline parallelism: schedules as data (actions.py, schedules.py), one simulator (simulate.py),
layer partitioning (partition.py) and timeline pictures (plot.py). Nothing here needs a process group."""
