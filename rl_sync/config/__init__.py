"""Configuration: `SyncConfig` (`sync`), loading YAML from `configs/` into the project's
dataclasses (`load`), and the driver-side checks on `WeightSync.push` arguments
(`push_args`).
"""
