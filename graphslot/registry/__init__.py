"""The registry layer (torch): buffers, the shared pool, the step checks, the
registry and its interpreter (the executable definition of the slot semantics)."""
