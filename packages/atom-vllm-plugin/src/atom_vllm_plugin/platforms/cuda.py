"""ATOM's platform for NVIDIA GPUs: vLLM's CudaPlatform plus ATOM's attention. [host: vllm]"""

from vllm.platforms.cuda import CudaPlatform

from atom_vllm_plugin.platforms.base import AtomPlatformMixin


class AtomCudaPlatform(AtomPlatformMixin, CudaPlatform):
    """vLLM's CudaPlatform (same device, same `PlatformEnum` identity) with ATOM's attention."""
