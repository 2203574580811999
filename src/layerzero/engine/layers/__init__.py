"""Model building blocks; every norm, RoPE, attention and activation call goes through an ``lz.*`` op."""
