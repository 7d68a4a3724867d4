"""What crosses processes: the strict msgpack codec (`codec`), dtype names (`dtypes`), the
coordinator <-> rank messages (`messages`), the compact per-rank plan (`plan_info`), and the
per-round statistics the driver reads (`stats`).
"""
