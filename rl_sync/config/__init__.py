"""Configuration: `SyncConfig` (`sync`), the adapter of a LoRA group (`LoraSpec`, `lora`),
loading YAML from `configs/` into the project's dataclasses (`load`), and the driver-side
checks on `WeightSync.push` arguments (`push_args`).
"""
