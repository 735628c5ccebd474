"""System presets (TOML): one file per system, units in key names."""
