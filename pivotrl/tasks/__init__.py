"""pivotrl.tasks"""
