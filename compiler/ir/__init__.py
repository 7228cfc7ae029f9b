"""The intermediate representation: what every layer above speaks and nothing below it.

Program and ParamSpec, placements, Plan, MeshSpec (a mesh's topology with no process group), schedules
as data and their simulator, errors. Imports only torch and meshc.compiler._torch_compat.
"""
