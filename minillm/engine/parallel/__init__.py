"""Tensor parallelism: one model split over several processes (CPU ranks through MPI) or GPUs (NCCL).

`communicator` is the small interface the model sees (all_reduce, all_gather, broadcast, barrier)
and its backends: one process, threads of one process (tests, lessons), MPI through mpi4py, NCCL
through CuPy. `sharding` says which slice of each weight rank r of N holds (Megatron's split) and
refuses shapes that do not divide. `launcher` starts the N ranks under `mpiexec` and makes each one
exit cleanly. `cost` is the arithmetic of what tensor parallelism moves and where it stops paying.

It may import `minillm.model` and `minillm.checkpoints`; the model never imports from here: the
communicator is an object handed to the Transformer's constructor.
"""
