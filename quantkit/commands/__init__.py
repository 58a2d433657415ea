"""CLI commands: one module per command, each with `register(app)`. No logic lives here:
commands parse options, build the validated config, and call the library."""
