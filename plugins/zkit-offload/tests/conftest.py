import os

# Two cores are shared by several test processes: keep torch to one thread. (NUMBA_NUM_THREADS is
# left alone: changing it after another test module started Numba's threads is an error.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
