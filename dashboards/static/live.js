/* Live pages: every few seconds, while the tab is visible and "live" is ticked, fetch this same URL
 * and swap in its <main>, so that the server-rendered page stays the only renderer. The timeline
 * refreshes its own canvas (timeline.js) and listens for the same tick. */
(function () {
  "use strict";
  const KEY = "tokentrace.live";
  const box = document.getElementById("live");
  const period = Number(document.body.dataset.refresh || 0) * 1000;
  if (box) {
    box.checked = localStorage.getItem(KEY) !== "off";
    box.addEventListener("change", () => localStorage.setItem(KEY, box.checked ? "on" : "off"));
  }
  const picker = document.getElementById("since");
  if (picker) picker.addEventListener("change", () => picker.form.submit());
  let busy = false;

  async function tick() {
    if (busy || !box || !box.checked || document.visibilityState !== "visible") return;
    busy = true;
    try {
      if (document.body.dataset.live === "event") {
        document.dispatchEvent(new CustomEvent("tokentrace:tick"));
        return;
      }
      const response = await fetch(location.href, {headers: {Accept: "text/html"}, credentials: "same-origin"});
      if (!response.ok) return;
      const doc = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = doc.getElementById("content");
      const main = document.getElementById("content");
      if (fresh && main) {
        main.replaceWith(fresh);
        document.dispatchEvent(new CustomEvent("tokentrace:refreshed"));
      }
    } catch (err) {
      // The collector restarting or the network dropping is normal for a live page: try again next tick.
    } finally {
      busy = false;
    }
  }

  if (period > 0) setInterval(tick, period);
})();
