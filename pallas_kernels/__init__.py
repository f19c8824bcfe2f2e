"""Pallas kernels, one module per op: the kernel, a validated jitted wrapper and
``<op>_reference`` in pure jnp. Every kernel is tested against its reference in interpret mode."""
