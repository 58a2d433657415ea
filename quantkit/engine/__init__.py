"""quantkit.engine"""
