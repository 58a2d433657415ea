"""quantkit.calibration: calibration data for quantization (sources live in the top-level calibration/)."""
