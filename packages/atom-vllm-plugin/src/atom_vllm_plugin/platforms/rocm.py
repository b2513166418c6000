"""ATOM's platform for AMD GPUs: vLLM's RocmPlatform plus ATOM's attention. [host: vllm]"""

from vllm.platforms.rocm import RocmPlatform

from atom_vllm_plugin.platforms.base import AtomPlatformMixin


class AtomRocmPlatform(AtomPlatformMixin, RocmPlatform):
    """vLLM's RocmPlatform (same device, same `PlatformEnum` identity) with ATOM's attention."""
