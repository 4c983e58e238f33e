"""KDA (Kimi Delta Attention) ops, one module each."""
