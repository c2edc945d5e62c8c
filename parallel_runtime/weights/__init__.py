"""Model files and what a rank keeps of them: opening a file (`checkpoint`: safetensors, `gguf_file`: GGUF), the
key-map vocabulary (`keymap`) and the per-rank builder (`mapping`), the storage kinds (`storage`: the rule and
the compact-layer base; `fp8`, GGUF blocks in `gguf_file` / `gguf_quants`, ComfyUI layouts in `comfy_quant`),
and LoRA-style patches on the weights a rank holds (`patches`). Knows no model family."""
