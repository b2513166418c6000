"""ATOM's platform for vLLM's ZenCpuPlatform (AMD Zen CPUs with zentorch). [host: vllm]"""

from vllm.platforms.zen_cpu import ZenCpuPlatform

from atom_vllm_plugin.platforms.base import AtomPlatformMixin


class AtomZenCpuPlatform(AtomPlatformMixin, ZenCpuPlatform):
    """vLLM's ZenCpuPlatform (same device, same `PlatformEnum` identity) with ATOM's attention."""
