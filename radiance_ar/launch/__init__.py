"""Triton launch helpers shared by every kernel: a cached launcher bound once per
kernel and shape (``fast_launch``) and raw addresses as kernel arguments (``pointers``)."""
