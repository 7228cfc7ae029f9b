"""meshc.runtime: the mesh and its process groups, collectives, the per-rank job."""
