"""Kernel backends. Each subpackage registers its ops with ``atom_kernels.registry`` on import."""
