"""quantkit.eval"""
