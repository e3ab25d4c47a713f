"""opdefs"""
