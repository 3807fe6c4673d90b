"""durable"""
