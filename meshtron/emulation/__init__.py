"""Scale by emulation: one rank of a large layout run for real on the local device, every collective emulated
and recorded (docs/emulation.md)."""
