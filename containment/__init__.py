"""Containment of untrusted code: the jail (namespaces, read-only view, limits), the seccomp profiles,
process groups, and the compiler run inside the jail. Below gpu_worker/ and activities/, which use it;
above kopt/ (contracts) alone."""
