"""Fault tests: hostile packs, damaged files, kills and races, run against every command and reader."""
