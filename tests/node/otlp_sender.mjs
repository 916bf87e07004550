// Sends spans to a collector with the real OpenTelemetry JS SDK (OTLP/HTTP protobuf), the way a
// Node.js service would: a remote parent with a trace state, links with attributes and trace
// states, a scope version, a NaN double. Usage: node otlp_sender.mjs URL COUNT
import { context, createTraceState, trace } from "@opentelemetry/api";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { resourceFromAttributes } from "@opentelemetry/resources";
import { BasicTracerProvider, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";

const [url, count] = [process.argv[2], Number(process.argv[3] ?? "3")];
const provider = new BasicTracerProvider({
  resource: resourceFromAttributes({ "service.name": "node-sender" }),
  spanProcessors: [new SimpleSpanProcessor(new OTLPTraceExporter({ url }))],
});
const tracer = provider.getTracer("node.scope", "2.7.1");
const hex = (n) => [...crypto.getRandomValues(new Uint8Array(n))].map((b) => b.toString(16).padStart(2, "0")).join("");
const parent = trace.setSpanContext(context.active(), {
  traceId: hex(16), spanId: hex(8), traceFlags: 1, isRemote: true, traceState: createTraceState("congo=t61rcWkgMzE"),
});
const linked = [];
for (let i = 0; i < count; i++) {
  const target = { traceId: hex(16), spanId: hex(8), traceFlags: 1, traceState: createTraceState(`vendor=v${i}`) };
  linked.push(target);
  const span = tracer.startSpan(`node-span-${i}`, {
    links: [{ context: target, attributes: { "link.kind": "follows", "link.index": i } }],
    attributes: { "node.index": i, "node.nan": NaN },
  }, parent);
  span.end();
}
await provider.forceFlush();
await provider.shutdown();
console.log(JSON.stringify(linked.map(({ traceId, spanId }) => ({ traceId, spanId }))));
