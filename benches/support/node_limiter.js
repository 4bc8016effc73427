// The Node limiter the Redis store bench compares with: rate-limiter-flexible's RateLimiterRedis
// over one ioredis connection, checking clients of 10,000 at a fixed concurrency for a bounded
// time, every check a decision of a budget far larger than the load.
//
//   node node_limiter.js <port> <seconds> <concurrency>
//
// Prints one line: decisions/s, p50 µs, p99 µs, failed checks, decisions, client CPU µs per
// decision.
const Redis = require('ioredis');
const { RateLimiterRedis } = require('rate-limiter-flexible');

const [port, seconds, concurrency] = process.argv.slice(2).map(Number);
const CLIENTS = 10000;
const client = new Redis({ host: '127.0.0.1', port, maxRetriesPerRequest: 1 });
const limiter = new RateLimiterRedis({
  storeClient: client,
  keyPrefix: 'node-limiter',
  points: 1e9,
  duration: 3600,
});

async function main() {
  await client.ping();
  for (let i = 0; i < 100; i++) {
    await limiter.consume('warm-up');
  }
  const latencies = [];
  let failed = 0;
  const start = process.hrtime.bigint();
  const end = start + BigInt(seconds) * 1000000000n;
  const cpuBefore = process.cpuUsage();
  async function worker(first) {
    for (let n = first; process.hrtime.bigint() < end; n += concurrency) {
      const t0 = process.hrtime.bigint();
      try {
        await limiter.consume('client' + ((n * 7919) % CLIENTS));
        latencies.push(Number(process.hrtime.bigint() - t0) / 1000);
      } catch (e) {
        failed++;
      }
    }
  }
  await Promise.all(Array.from({ length: concurrency }, (_, w) => worker(w)));
  const elapsed = Number(process.hrtime.bigint() - start) / 1e9;
  const cpu = process.cpuUsage(cpuBefore);
  latencies.sort((a, b) => a - b);
  const at = (p) => latencies[Math.floor((latencies.length - 1) * p)] || 0;
  const decisions = latencies.length;
  console.log(
    [decisions / elapsed, at(0.5), at(0.99), failed, decisions, (cpu.user + cpu.system) / decisions]
      .map((v) => v.toFixed(2))
      .join(' '),
  );
  client.disconnect();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
