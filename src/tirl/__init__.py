"""tirl: tool-integrated reinforcement learning (a complete rStar2-Agent)."""

import os

from tirl.lifetime import adopt_parent_death

# torch's OpenMP worker threads spin while they wait for each other. On a CPU shared with other jobs
# a descheduled worker makes the rest spin through its whole time slice: copy-drill SFT steps ran
# 3.5x slower on the shared 2-core machine (benchmarks/omp_wait.py). Sleeping waits cost little when
# the machine is idle. Only takes effect when tirl is imported before torch; set the variable to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

adopt_parent_death()  # in a process a tirl command started: die with it, leave Ctrl-C to it
