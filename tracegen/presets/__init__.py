"""Preset data files (TOML) shipped with tracegen."""
