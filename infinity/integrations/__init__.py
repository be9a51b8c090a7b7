"""Adapters for the frameworks users already train with: Lightning, Fabric, Accelerate, transformers.

One module per framework, each a thin layer over infinity's public API
(initialize, the engine, zero.Init), imported only by the user who asks for
it; none imports deepspeed. See docs/ARCHITECTURE.md.
"""
