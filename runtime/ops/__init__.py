"""The functions graph nodes call: collectives, ZeRO gather/reduce, tensor-parallel ops, remat.

A leaf over torch, meshc.kernels and the IR: groups are passed by name, nothing here holds a process
group or knows the executor (a ZeRO op finds the step's context through a context variable).
"""
