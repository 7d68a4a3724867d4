"""Sparse rounds, the pure part: delta encodings and their sizes (`encodings`), the `auto`
choice between sparse and dense (`auto`), and vLLM-style flat-index patches (`patches`).
The torch and Triton codecs that run them live in `rl_sync.engine`.
"""
