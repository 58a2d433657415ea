"""quantkit.serve"""
