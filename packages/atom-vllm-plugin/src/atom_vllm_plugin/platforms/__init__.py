"""ATOM's vLLM platforms: one module per vLLM parent platform (`cuda`, `rocm`, `cpu`, `zen_cpu`),
each a subclass that keeps the parent's identity and adds ATOM's attention backend selection
(`base.AtomPlatformMixin`)."""
