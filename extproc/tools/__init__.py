"""Instruments that test or measure the product: mock vLLM, local stack, simulator, benchmarks, top.

Nothing in the product (core, brain, envoy_config, contract, config) imports from here.
"""
