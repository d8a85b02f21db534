"""pivotrl.sim"""
