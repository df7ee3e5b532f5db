"""Shared by the LMCache adapter's tests (lmcache_adapter/) and the vLLM connector's
(vllm_connector/): ``adapter_deployment``, the kvfabric deployment they run against.

pytest (its default "prepend" import mode) puts the directory of each conftest.py it loads
on ``sys.path``: this file is what makes ``import adapter_deployment`` work from both.
"""
