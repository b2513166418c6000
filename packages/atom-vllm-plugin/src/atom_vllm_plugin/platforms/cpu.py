"""ATOM's platform for vLLM's CPU build: vLLM's CpuPlatform plus ATOM's attention. [host: vllm]"""

from vllm.platforms.cpu import CpuPlatform

from atom_vllm_plugin.platforms.base import AtomPlatformMixin


class AtomCpuPlatform(AtomPlatformMixin, CpuPlatform):
    """vLLM's CpuPlatform (same device, same `PlatformEnum` identity) with ATOM's attention."""
