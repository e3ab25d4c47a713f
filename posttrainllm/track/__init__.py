"""track"""
