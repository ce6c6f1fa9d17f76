"""Test-only code: the GPU-shaped harness and its stand-ins. No module a run imports imports this
package, except :func:`megarl.runtime.init_distributed` when a test sets ``MEGARL_GPU_SHAPED=1``."""
