"""quantkit.model"""
