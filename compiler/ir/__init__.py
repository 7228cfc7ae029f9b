"""The intermediate representation: what every layer above speaks and nothing below it.

Program and ParamSpec (and the node metadata keys), placements, Plan, MeshSpec (a mesh's topology with no
process group), schedules as data and their simulator, FX helpers (fx_ops: op names, view ops, arg paths),
errors. Imports only torch and meshc.compiler.ir.torch_compat.
"""
