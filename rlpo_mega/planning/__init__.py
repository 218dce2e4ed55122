"""`rlpo-mega plan`: a config at its real size, on a CPU (meta_build -> memory -> plan)."""
