"""Test-only code: the GPU-shaped harness and its stand-ins. No module a run imports imports this
package, except :func:`megarl.runtime.init_distributed` when a test sets ``MEGARL_GPU_SHAPED=1``,
and Ray's ``ray.init`` when the suite sets ``RAY_RUNTIME_ENV_HOOK`` (:mod:`megarl.testing.ray_fork`)."""
